"""Multi-device execution: tensor parallelism (GSPMD shardings) and data parallelism."""
