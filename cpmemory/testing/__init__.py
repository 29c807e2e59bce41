"""Test tooling shipped with cpmemory: a mock OpenAI-compatible engine with KV events and throw-away Redis
servers. Not used by the runtime packages (an import contract checks it)."""
