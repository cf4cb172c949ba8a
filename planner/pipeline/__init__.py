"""Pipeline parallelism: stages over the op graph, micro-batches and their schedules
(docs/simulator.md, "Pipelines")."""
