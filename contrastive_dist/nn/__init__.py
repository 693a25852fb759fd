"""Layers that need every rank (synchronized BatchNorm, exact on uneven and empty ranks); the gradient cache."""
