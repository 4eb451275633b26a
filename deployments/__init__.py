"""Ray Serve layer over `specdec`: Drafter, Verifier and an OpenAI-compatible Ingress."""
