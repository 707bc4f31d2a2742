"""The scheduler: admission, a bounded queue, routing to live executors, aborts, failover."""
