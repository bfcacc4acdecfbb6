"""The only package that imports the web framework: the app and its routes table, the gate (API
key, body size, timeouts), lifecycle and signals, health/metrics/slots formatting, the web UI
and its control plane, CORS and the API prefix; routes hand validated bodies to api/."""
