"""Serving measurement: workloads, the streaming load client, metrics, plan (sizing) and tune (batch size)."""
