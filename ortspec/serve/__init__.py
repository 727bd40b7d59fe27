"""``ortspec serve``: an OpenAI-compatible HTTP server over one continuous batcher.

    server.py    the Session, the engine thread and uvicorn, started and stopped together
    engine.py    the one thread that drives the batcher; jobs, events, the bounded queue
    app.py       Starlette routes: /v1/completions, /v1/chat/completions, /health, /metrics
    protocol.py  the OpenAI request and response bodies
    chat.py      the model's chat template
    metrics.py   /metrics in Prometheus' text format

Needs the ``serve`` extra (pip install 'ortspec[serve]': starlette, uvicorn, jinja2).
"""
