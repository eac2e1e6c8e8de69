"""Real adapters for the trainer's ports: the rewards topic (Kafka), the increment job (Ray
Train) and experiment tracking (MLflow). Only this package imports those clients."""
