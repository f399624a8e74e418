"""The `hpcserve` command: every subcommand, thin, over hpcserve.api and the workflows. The only package
that imports typer and rich tables."""
