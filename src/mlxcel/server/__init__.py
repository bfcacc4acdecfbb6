"""The only package that imports the web framework: the app and its routes table, the gate (API
key, body size, timeouts), lifecycle and signals, health/metrics/slots formatting, the live
settings (F9, applied through `state.ServerState`), the web UI and its control plane, CORS and the
API prefix; routes hand validated bodies to api/. It sits below the entry points: it never imports
startup or the command line; what startup builds (the process, the run-time model `Loader`, the
realtime service) is handed in."""
