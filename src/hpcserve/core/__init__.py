"""What every layer shares: the error tree, the validated config schema, typed statuses, the registry of
deployments, the files of a run folder, and small OS helpers. Imports nothing else of hpcserve."""
