"""The gateway's HTTP server: uvicorn (httptools) with a connection guard (``protocol``),
the ASGI application around :class:`services.gateway.server.Gateway` and the server that
runs it (``app``)."""
