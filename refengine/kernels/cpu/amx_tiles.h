/* What both AMX kernels (gemm_amx.c, paged_attention_amx.h) need of the tiles: the configuration
 * record, loading it, and Linux's permission to use them. Include after <immintrin.h> and
 * <string.h>, with _GNU_SOURCE defined before any system header (for syscall()). */
#ifndef AMX_TILES_H
#define AMX_TILES_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The 64-byte tile configuration, palette 1: each tile's rows and bytes per row. */
typedef struct __attribute__((packed)) {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* A configuration with every one of the 8 tiles 16 rows of 64 bytes, for the caller to adjust. */
static inline AmxConfig amx_full_tiles(void)
{
    AmxConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    return config;
}

/* Loads it. The barrier: GCC 12's _tile_loadconfig tells the compiler it reads 8 of the 64 bytes,
 * so the stores that filled the rest could be dropped (at -O2 they were, in a test build). */
static inline void amx_load_config(const AmxConfig *config)
{
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(config);
}

/* Linux hands out the AMX register state on request only (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA), once per process; 1 when granted. */
static inline int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
#endif
