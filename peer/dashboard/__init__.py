"""The web dashboard: `history` (what it draws, from status reports), `server` (the page and
its JSON over HTTP), `page.html` (the page itself: no external assets), `service` (a
backbone's or `peer status --serve`'s reads of the records)."""
