"""The packed N:M checkpoint: pruned matrices as kept values plus a bit mask or group indices."""
