"""The OpenVINO backend (CPU): ``runner`` (one ``OvRunner`` per graph over one compiled model, its lazy
form and KV decoder, the compile check in a child process)."""
