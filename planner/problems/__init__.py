"""Problems and files: cost tables (Problem), the cost-table JSON format, strategies and their files, evaluators and the expert baselines."""
