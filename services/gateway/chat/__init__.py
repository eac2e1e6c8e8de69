"""Chat answers: the tools a request declares, the tool calls an engine answers with, their
validation against the declared schemas, and what kind of answer each one is
(docs/gateway.md, "Tool calls" and "What kind of answer")."""
