"""Ray actors, one class per role, and the WorkerGroup that calls them by bound method."""
