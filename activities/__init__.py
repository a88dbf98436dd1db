"""Every side effect of an episode: model calls, the REPL sandbox, the audit store."""
