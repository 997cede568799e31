/*
 * JPEG decoding with libjpeg-turbo, for worker/src/ops/jpeg/turbo.rs.
 *
 * libjpeg reports errors by calling error_exit, which must not return; here it longjmps back
 * to the function that called libjpeg, so no jump ever crosses a Rust frame. Warnings are
 * corrupt data libjpeg would otherwise paper over (a premature end is filled with grey), so
 * they are errors too.
 *
 * A window decode asks libjpeg for only what the window needs: jpeg_crop_scanline skips the
 * IDCT, upsampling and colour conversion of the columns outside it, jpeg_skip_scanlines the
 * rows above it, and decoding stops after its last row (the entropy-coded data below is never
 * read). A scale of 1/2, 1/4 or 1/8 decodes with a reduced IDCT.
 */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#define MESSAGE_BYTES 200

struct failure {
  struct jpeg_error_mgr mgr;
  jmp_buf jump;
  char *message;
};

static void on_error(j_common_ptr c) {
  struct failure *f = (struct failure *)c->err;
  char text[JMSG_LENGTH_MAX];
  (*c->err->format_message)(c, text);
  snprintf(f->message, MESSAGE_BYTES, "%s", text);
  longjmp(f->jump, 1);
}

static void on_message(j_common_ptr c, int level) {
  if (level < 0) on_error(c);
}

static void start(struct jpeg_decompress_struct *c, struct failure *f, char *message,
                  const unsigned char *data, unsigned long size, unsigned long max_memory) {
  c->err = jpeg_std_error(&f->mgr);
  f->mgr.error_exit = on_error;
  f->mgr.emit_message = on_message;
  f->message = message;
  jpeg_create_decompress(c);
  /* Bounds what a progressive image's coefficient buffers may take. */
  c->mem->max_memory_to_use = (long)max_memory;
  jpeg_mem_src(c, data, size);
}

/* The image's size, and whether libjpeg can give it as RGB or grey (not CMYK or YCCK).
 * 0 on success, else 1 with `message` set. */
int stoker_jpeg_header(const unsigned char *data, unsigned long size, unsigned long *height,
                       unsigned long *width, int *rgb_or_grey, char *message) {
  struct jpeg_decompress_struct c;
  struct failure f;
  start(&c, &f, message, data, size, 1 << 20);
  if (setjmp(f.jump)) {
    jpeg_destroy_decompress(&c);
    return 1;
  }
  jpeg_read_header(&c, TRUE);
  *height = c.image_height;
  *width = c.image_width;
  *rgb_or_grey = c.jpeg_color_space == JCS_YCbCr || c.jpeg_color_space == JCS_GRAYSCALE ||
                 c.jpeg_color_space == JCS_RGB;
  jpeg_destroy_decompress(&c);
  return 0;
}

/* Decodes the window [top, top + height) x [left, left + width) of the image scaled by
 * 1/denom (1, 2, 4 or 8; the window is in scaled pixels) as `channels` (1 grey, 3 RGB, 4 RGBA
 * with opaque alpha) into `out`, height * width * channels bytes. 0 on success, else 1 with
 * `message` set. */
int stoker_jpeg_decode(const unsigned char *data, unsigned long size, int channels, int denom,
                       unsigned long top, unsigned long left, unsigned long height,
                       unsigned long width, unsigned long max_memory, unsigned char *out,
                       char *message) {
  struct jpeg_decompress_struct c;
  struct failure f;
  start(&c, &f, message, data, size, max_memory);
  if (setjmp(f.jump)) {
    jpeg_destroy_decompress(&c);
    return 1;
  }
  jpeg_read_header(&c, TRUE);
  c.out_color_space = channels == 1 ? JCS_GRAYSCALE : channels == 4 ? JCS_EXT_RGBA : JCS_RGB;
  c.scale_num = 1;
  c.scale_denom = (unsigned int)denom;
  c.dct_method = JDCT_ISLOW;
  c.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&c);
  if (c.output_components != channels || top + height > c.output_height ||
      left + width > c.output_width || height == 0 || width == 0) {
    snprintf(message, MESSAGE_BYTES,
             "window %lux%lu at (%lu, %lu) outside the %ux%u image of %d components", height,
             width, top, left, c.output_height, c.output_width, c.output_components);
    jpeg_destroy_decompress(&c);
    return 1;
  }
  /* Columns: libjpeg widens the window to whole iMCU columns, and upsamples chroma at the
   * edges of what it decodes as at the image's edges; asking for one more column on each
   * side keeps those edge columns out of ours. `shift` is where ours starts. */
  JDIMENSION x = left > 0 ? (JDIMENSION)left - 1 : 0;
  JDIMENSION end = left + width < c.output_width ? (JDIMENSION)(left + width + 1) : c.output_width;
  JDIMENSION w = end - x;
  if (w < c.output_width) jpeg_crop_scanline(&c, &x, &w);
  size_t shift = (size_t)(left - x) * (size_t)channels;
  if (top > 0 && jpeg_skip_scanlines(&c, (JDIMENSION)top) != top) {
    snprintf(message, MESSAGE_BYTES, "could not skip to row %lu", top);
    jpeg_destroy_decompress(&c);
    return 1;
  }
  /* Freed with the decompressor, also after an error. */
  JSAMPARRAY row = (*c.mem->alloc_sarray)((j_common_ptr)&c, JPOOL_IMAGE, c.output_width * channels, 1);
  size_t stride = (size_t)width * (size_t)channels;
  for (unsigned long r = 0; r < height; r++) {
    if (jpeg_read_scanlines(&c, row, 1) != 1) {
      snprintf(message, MESSAGE_BYTES, "row %lu of the window did not decode", top + r);
      jpeg_destroy_decompress(&c);
      return 1;
    }
    memcpy(out + r * stride, row[0] + shift, stride);
  }
  /* The rows below the window are never decoded. */
  jpeg_destroy_decompress(&c);
  return 0;
}
