"""The lookahead expert predictor: the model, routing traces recorded from a loaded model, and its
training and evaluation (Hot Recall)."""
