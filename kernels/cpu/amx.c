/* AMX: tile state from the kernel once per process, tiles configured per thread.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- AMX: the process asks the kernel once for the tile state; each thread configures its tiles ---- */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state; /* 0: not asked yet, 1: usable, -1: refused by the kernel */

static int amx_usable(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

static void amx_configure(void) { /* tiles 0-3: C (16 x 16 fp32), 4-5: A (16 x 32 bf16), 6-7: B (16 x 32 bf16) */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
static int amx_usable(void) { return 0; }
#endif

