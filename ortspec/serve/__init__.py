"""``ortspec serve``: an OpenAI-compatible HTTP server over one continuous batcher.

    server.py    the Session, the engine thread and uvicorn, started and stopped together
    engine.py    the one thread that drives the batcher; jobs, events, the bounded queue
    app.py       Starlette routes: /v1/completions, /v1/chat/completions, /health, /metrics
    answer.py    one request's choices as events arrive: text cut at stop strings, the bodies
    protocol.py  the OpenAI request and response bodies
    logprobs.py  the OpenAI logprobs objects
    chat.py      the model's chat template
    metrics.py   /metrics in Prometheus' text format
    ray.py       N replicas on Ray Serve (ortspec serve --replicas N)

Needs the ``serve`` extra (pip install 'ortspec[serve]': starlette, uvicorn, jinja2); replicas
the ``ray`` extra (pip install 'ortspec[ray]').
"""
