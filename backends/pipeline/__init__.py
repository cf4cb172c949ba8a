"""Pipeline parallelism searched: stages, micro-batches, schedules (`search.search_pipeline`)."""
