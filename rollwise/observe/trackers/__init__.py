"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) behind one interface (base.Tracker)."""
