"""Real adapters for the deployer's ports (MLflow registry). Only this package imports MLflow."""
