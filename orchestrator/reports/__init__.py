"""What a person reads: the run report, compare and its statistics, tables, plots, trackers."""
