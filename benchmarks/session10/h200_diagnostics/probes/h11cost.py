import asyncio, sys, threading, time, statistics, http.client, json, socket
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse, JSONResponse
from starlette.routing import Route
N = int(sys.argv[2]) if len(sys.argv) > 2 else 32
async def stream(request):
    body = await request.json()
    async def gen():
        for i in range(body["n"]):
            yield f"data: {json.dumps({'choices': [{'text': 'x', 'index': 0}]})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")
app = Starlette(routes=[Route("/s", stream, methods=["POST"])])
def serve(http, loop, port):
    cfg = uvicorn.Config(app, port=port, log_level="warning", http=http, loop=loop, lifespan="off")
    uvicorn.Server(cfg).run()
http_kind, loop = sys.argv[1].split("+")
port = 8765
threading.Thread(target=serve, args=(http_kind, loop, port), daemon=True).start()
time.sleep(1.0)
def req(n):
    c = http.client.HTTPConnection("127.0.0.1", port); t = time.perf_counter()
    c.request("POST", "/s", json.dumps({"n": n}), {"Content-Type": "application/json"})
    r = c.getresponse()
    while r.readline(): pass
    c.close(); return time.perf_counter() - t
for n in (1, N):
    lat = [req(n) for _ in range(50)]
    print(f"{sys.argv[1]} chunks={n}: p50 {statistics.median(lat)*1e3:.3f} ms")
