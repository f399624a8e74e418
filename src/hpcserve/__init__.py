"""hpcserve: serve large language models on HPC clusters (Slurm -> Ray -> vLLM), each layer proven first."""

__version__ = "0.1.0"
