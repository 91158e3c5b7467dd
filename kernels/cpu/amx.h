/* AMX tiles: the permission request and the one tile shape the kernels use */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this process may use AMX tiles (asks Linux for the permission once) */
int amx_ready(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct { uint8_t palette; uint8_t start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* every tile 16 rows x 64 bytes (each kernel says what its tiles hold) */
static void tiles_on(void) {
  tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}
