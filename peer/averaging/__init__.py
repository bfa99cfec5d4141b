"""Averaging: matchmaking into groups and the butterfly all-reduce with the solver's shares."""
