"""Multi-device execution: tensor parallelism (GSPMD shardings) and multi-host serving (the
leader's device calls broadcast to the other processes). Data parallelism, replicas of
the whole engine, is `jaxserve.engine.data_parallel`."""
