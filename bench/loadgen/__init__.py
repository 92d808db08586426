"""Load generator and goodput harness for any OpenAI-compatible endpoint (`ferry bench serve`).

Mental model: a *workload* is a list of `BenchRequest`s (arrival time, prompt and output length,
Mooncake prefix block ids, tenant, SLO class), built from a real trace or a synthetic arrival
process and scaled to fit this machine. The *client* replays it against one loopback URL with
streaming completions and records one `ClientRecord` (send time, chunk times, token counts) per
request. *Metrics* turn records into the numbers `vllm bench serve` prints (TTFT, TPOT, ITL, E2E,
throughput, goodput) plus per-tenant SLO attainment. *Peers* start and stop the servers compared
in one run (ferry colocated/disaggregated, llama-server, llama-cpp-python), and *report* writes
JSON, PNG plots and `bench/RESULTS.md`.

    workload.py  traces + scaling          arrivals.py  Poisson / gamma processes
    prompts.py   hash-id -> token blocks   client.py    streaming replay
    metrics.py   vLLM metric math          peers.py     server lifecycles
    report.py    JSON, plots, RESULTS.md   cli.py       argparse + single run + sweep
"""
