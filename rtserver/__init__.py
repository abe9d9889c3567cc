"""rtserver: a realtime chat server for small instruct LLMs. Packages by layer — engine, tasks, web,
tools — described in docs/architecture.md."""
