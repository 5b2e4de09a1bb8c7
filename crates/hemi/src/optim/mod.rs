//! Optimizers (SGD, Adam, AdamW), learning-rate schedules and gradient clipping.
