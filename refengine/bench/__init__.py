"""``refengine bench``: a load generator for any OpenEngine v0.1.0 server, with the flags
and metrics of vllm's ``bench serve``, so that engines can be compared through one contract.

``workload`` builds the requests (random or a JSONL dataset) and their arrival times,
``target`` asks the server what to send, ``runner`` sends them and records what each saw,
``report`` turns the records into the metrics (the JSON keys are listed there). It talks to
the server only through the generated stubs and ``refengine.client``.
"""

UINT32_MAX = 2**32 - 1  # token ids, max_tokens and top_n are uint32 on the wire (here: the CLI imports it cheaply)
#: The latencies a ``--goodput`` objective may bound, in ms (``report.meets``).
SLO_METRICS = ("ttft", "tpot", "e2el")
