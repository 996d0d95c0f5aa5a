"""Tools that run on a host beside the worker, stdlib only: run control (``launch``), the host probe
(``probe``, piped into the host's interpreter as one file), the Ray actor (``ray_task``) and process
and file primitives (``proc``)."""
