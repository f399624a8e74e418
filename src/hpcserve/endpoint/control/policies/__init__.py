"""The controller's policies, one step each per round behind one interface (base.Policy, seeing the
controller as base.ControlPlane): how many members serve (scaling: self-healing and autoscale), the
walltime handover, `down --member` (member_requests), and the data plane's migrations written down."""
