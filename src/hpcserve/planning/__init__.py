"""Pure planning: model shapes, the model catalogue, the throughput model, the layout planner and its
report. No I/O beyond reading a model's config.json."""
