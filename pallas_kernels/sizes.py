"""Power-of-two sizes: the tiles of the kernels and the shapes their argument checks accept."""


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
