"""The front doors: the Starlette app, the /ws hub, the agent console, the HTTP API, the wire protocol,
sessions, rate limits and metrics (docs/architecture.md). Uses tasks and the inference seam; imports
nothing from rtbench."""
