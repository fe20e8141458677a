"""`kvstrata bench`: a serving benchmark for any OpenAI-compatible endpoint (kvstrata, SGLang, vLLM).

``prompts`` builds random token-id prompts from the served model's tokenizer, ``client`` runs one
streaming request and times its chunks, ``runner`` drives many of them (arrival rate, concurrency cap,
progress bar), ``metrics`` turns the timings into SGLang ``bench_serving``'s figures and key names, and
``cli`` is the command.
"""
