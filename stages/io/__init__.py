"""Storage: Delta tables with lineage, table schemas, checkpoints, SQL, MLflow tracking, plots."""
