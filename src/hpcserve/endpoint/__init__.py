"""The endpoint: one OpenAI URL in front of member deployments. The router process (data plane), the
controller that decides membership, healing, scaling and handover (control plane), and the decisions as
pure functions."""
