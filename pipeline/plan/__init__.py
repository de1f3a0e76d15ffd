"""Plan before you allocate: the memory per device, term by term, and the time and cost of a run config on
a cluster described as ``NODESxGPUSxTYPE``, with the cheapest change that makes a config fit.

What it offers:
- `hardware`: the device table (``GPUS``, ``cpu``) and ``parse_cluster``;
- `memory`: model states by ZeRO stage, offload and expert parallelism, DeepSpeed's buffers (`Setup`,
  `ModelShape`);
- `activations`: activations, the loss's buffers and the peak of a micro-step, from the families' counts;
- `step`: the step's compute and collectives, their time, tokens/s;
- `report`: ``plan``, ``render``, ``advise``, ``refusal``, ``as_json``;
- `measure` and `comm_probe`: what a real step on this CPU keeps and communicates, which the planner is
  checked against (`validation` names the cases).
"""
