"""Running one model across several ranks: tensor and expert parallel, and the executors that run the ranks."""
