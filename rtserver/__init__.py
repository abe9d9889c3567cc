"""rtserver: a realtime chat server for small instruct LLMs. Packages by layer — engine, tasks, web —
described in docs/architecture.md; the measuring tools are the rtbench package, on top."""
