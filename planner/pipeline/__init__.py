"""Pipeline parallelism: stages over the op graph, micro-batches and their schedules
(docs/simulator.md, "Pipelines"), and what the pipeline search solves (`problem`:
`PipelineProblem`, `Layout`)."""
