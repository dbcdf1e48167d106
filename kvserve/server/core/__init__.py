"""What every API shares: serving, streaming, errors, auth and tenancy, metrics, limits, shutdown."""
