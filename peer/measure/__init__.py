"""Measuring what a peer can do: compute throughput, link bandwidth and RTT, reachability."""
