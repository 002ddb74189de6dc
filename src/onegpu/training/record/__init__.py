"""What a run records: per-optimizer-step measurement (:mod:`.recorder`), the per-run figure
(:mod:`.figure`), its name and tags in MLflow (:mod:`.run_tags`) and the closing record written on the way
out (:mod:`.closing_record`)."""
