"""Faults during a load test: schedules (data), injectors (one per event kind), and the history checker."""
