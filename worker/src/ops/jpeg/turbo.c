/*
 * JPEG decoding with libjpeg-turbo, for worker/src/ops/jpeg/turbo.rs.
 *
 * libjpeg reports errors by calling error_exit, which must not return; here it longjmps back
 * to the function that called libjpeg, so no jump ever crosses a Rust frame. Warnings are
 * corrupt data libjpeg would otherwise paper over (a premature end is filled with grey), so
 * they are errors too.
 *
 * The header is read once (stoker_jpeg_open), so the caller can choose a window from the
 * image's size before anything is decoded. A window decode asks libjpeg for only what the
 * window needs: jpeg_crop_scanline skips the IDCT, upsampling and colour conversion of the
 * columns outside it, jpeg_skip_scanlines the rows above it, and decoding stops after its
 * last row (the entropy-coded data below is never read). A scale of 1/2, 1/4 or 1/8 decodes
 * with a reduced IDCT. Rows are decoded straight into the caller's buffer.
 *
 * stoker_jpeg_restart rewrites a JPEG without loss with restart markers, so that later a
 * window can be decoded from the segments around it alone (segments.rs).
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
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

/* One JPEG being decoded: the decompressor, its error handler and its last message. Its
 * address must not change between calls (libjpeg keeps pointers into it), so it is allocated
 * here. Every entry point sets the jump before it calls libjpeg. */
struct stoker_jpeg {
  struct jpeg_decompress_struct c;
  struct failure f;
  char message[MESSAGE_BYTES];
  int alive;
};

const char *stoker_jpeg_message(const struct stoker_jpeg *j) { return j->message; }

/* Reads the header: the image's size, and whether libjpeg can give it as RGB or grey (not
 * CMYK or YCCK). NULL only if out of memory; otherwise call stoker_jpeg_free, and on a
 * nonzero `*failed` read the message. */
struct stoker_jpeg *stoker_jpeg_open(const unsigned char *data, unsigned long size,
                                     unsigned long max_memory, unsigned long *height,
                                     unsigned long *width, int *rgb_or_grey, int *failed) {
  struct stoker_jpeg *j = calloc(1, sizeof *j);
  if (j == NULL) return NULL;
  j->c.err = jpeg_std_error(&j->f.mgr);
  j->f.mgr.error_exit = on_error;
  j->f.mgr.emit_message = on_message;
  j->f.message = j->message;
  *failed = 1;
  if (setjmp(j->f.jump)) return j;
  jpeg_create_decompress(&j->c);
  j->alive = 1;
  /* Bounds what a progressive image's coefficient buffers may take. */
  j->c.mem->max_memory_to_use = (long)max_memory;
  jpeg_mem_src(&j->c, data, size);
  jpeg_read_header(&j->c, TRUE);
  *height = j->c.image_height;
  *width = j->c.image_width;
  *rgb_or_grey = j->c.jpeg_color_space == JCS_YCbCr || j->c.jpeg_color_space == JCS_GRAYSCALE ||
                 j->c.jpeg_color_space == JCS_RGB;
  *failed = 0;
  return j;
}

/* Starts decoding the window [top, top + height) x [left, left + width) of the image scaled
 * by 1/denom (1, 2, 4 or 8; the window is in scaled pixels) as `channels` (1 grey, 3 RGB, 4
 * RGBA with opaque alpha). libjpeg widens the columns it decodes to whole iMCU columns:
 * `*row_width` is the width of each row it will give and `*shift` where the window starts in
 * it. 0 on success, else 1 with the message set. */
int stoker_jpeg_start(struct stoker_jpeg *j, int channels, int denom, unsigned long top,
                      unsigned long left, unsigned long height, unsigned long width,
                      unsigned long *row_width, unsigned long *shift) {
  struct jpeg_decompress_struct *c = &j->c;
  if (setjmp(j->f.jump)) return 1;
  c->out_color_space = channels == 1 ? JCS_GRAYSCALE : channels == 4 ? JCS_EXT_RGBA : JCS_RGB;
  c->scale_num = 1;
  c->scale_denom = (unsigned int)denom;
  c->dct_method = JDCT_ISLOW;
  c->do_fancy_upsampling = TRUE;
  jpeg_start_decompress(c);
  if (c->output_components != channels || top + height > c->output_height ||
      left + width > c->output_width || height == 0 || width == 0) {
    snprintf(j->message, MESSAGE_BYTES,
             "window %lux%lu at (%lu, %lu) outside the %ux%u image of %d components", height,
             width, top, left, c->output_height, c->output_width, c->output_components);
    return 1;
  }
  /* libjpeg upsamples chroma at the edges of what it decodes as at the image's edges; asking
   * for one more column on each side keeps those edge columns out of the window. */
  JDIMENSION x = left > 0 ? (JDIMENSION)left - 1 : 0;
  JDIMENSION end = left + width < c->output_width ? (JDIMENSION)(left + width + 1) : c->output_width;
  /* libjpeg upsamples chroma by repeating it, not by its smooth filter, in a decode at most
   * two chroma samples wide (4 px): a narrow window is decoded at least 16 px wide. */
  if (end - x < 16) {
    end = x + 16 < c->output_width ? x + 16 : c->output_width;
    x = end > 16 ? end - 16 : 0;
  }
  JDIMENSION w = end - x;
  if (w < c->output_width) jpeg_crop_scanline(c, &x, &w);
  *row_width = c->output_width;
  *shift = left - x;
  if (top > 0 && jpeg_skip_scanlines(c, (JDIMENSION)top) != top) {
    snprintf(j->message, MESSAGE_BYTES, "could not skip to row %lu", top);
    return 1;
  }
  return 0;
}

/* Decodes the next `rows` rows straight into `out`, `stride` bytes apart (at least the row
 * width times the channels). The rows below them are never decoded. 0 on success, else 1
 * with the message set. */
int stoker_jpeg_read(struct stoker_jpeg *j, unsigned char *out, unsigned long rows,
                     unsigned long stride) {
  enum { AT_ONCE = 16 };
  JSAMPROW at[AT_ONCE];
  /* volatile: read again after a longjmp. */
  volatile unsigned long done = 0;
  if (setjmp(j->f.jump)) return 1;
  while (done < rows) {
    unsigned long n = rows - done < AT_ONCE ? rows - done : AT_ONCE;
    for (unsigned long i = 0; i < n; i++) at[i] = out + (done + i) * stride;
    JDIMENSION got = jpeg_read_scanlines(&j->c, at, (JDIMENSION)n);
    if (got == 0) {
      snprintf(j->message, MESSAGE_BYTES, "row %lu of the window did not decode", done);
      return 1;
    }
    done += got;
  }
  return 0;
}

/* One JPEG being rewritten with restart markers: the decompressor it is read with, the
 * compressor it is written with, and their shared error handler. */
struct restarting {
  struct jpeg_decompress_struct in;
  struct jpeg_compress_struct out;
  struct failure f;
  int in_alive, out_alive;
};

/* Rewrites the JPEG in `data` without loss (its DCT coefficients are copied, as jpegtran
 * does) as one sequential scan with optimised Huffman tables and a restart marker every
 * `*interval` MCUs: the largest divisor of the MCUs in a row whose segments are at most
 * `segment_px` pixels wide, so every row of MCUs is whole segments. Its markers (APPn, COM)
 * are kept. On success 0, `*out` (malloc'd: free it with stoker_jpeg_free_bytes) and
 * `*out_size`; else 1 with `message` (MESSAGE_BYTES) set. */
int stoker_jpeg_restart(const unsigned char *data, unsigned long size, unsigned long max_memory,
                        unsigned long segment_px, unsigned char **out, unsigned long *out_size,
                        unsigned long *interval, char *message) {
  struct restarting *r = calloc(1, sizeof *r);
  /* volatile: read again after a longjmp. */
  volatile int failed = 1;
  *out = NULL;
  *out_size = 0;
  if (r == NULL) {
    snprintf(message, MESSAGE_BYTES, "out of memory");
    return 1;
  }
  r->in.err = jpeg_std_error(&r->f.mgr);
  r->out.err = &r->f.mgr;
  r->f.mgr.error_exit = on_error;
  r->f.mgr.emit_message = on_message;
  r->f.message = message;
  if (setjmp(r->f.jump)) goto done;
  jpeg_create_decompress(&r->in);
  r->in_alive = 1;
  r->in.mem->max_memory_to_use = (long)max_memory;
  jpeg_mem_src(&r->in, data, size);
  jpeg_save_markers(&r->in, JPEG_COM, 0xFFFF);
  for (int m = 0; m < 16; m++) jpeg_save_markers(&r->in, JPEG_APP0 + m, 0xFFFF);
  jpeg_read_header(&r->in, TRUE);
  jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&r->in);
  jpeg_create_compress(&r->out);
  r->out_alive = 1;
  jpeg_mem_dest(&r->out, out, out_size);
  jpeg_copy_critical_parameters(&r->in, &r->out);
  r->out.optimize_coding = TRUE;
  /* The MCU's width: one block of the only component, else every component's blocks. */
  jpeg_component_info *first = &r->in.comp_info[0];
  unsigned long h_max = (unsigned long)r->in.max_h_samp_factor;
  unsigned long mcu_px = r->in.num_components == 1 ? DCTSIZE * h_max / (unsigned long)first->h_samp_factor
                                                   : DCTSIZE * h_max;
  unsigned long per_row = (r->in.image_width + mcu_px - 1) / mcu_px;
  unsigned long every = 1;
  for (unsigned long d = 1; d <= per_row && d * mcu_px <= segment_px; d++)
    if (per_row % d == 0) every = d;
  r->out.restart_interval = (unsigned int)every;
  *interval = every;
  jpeg_write_coefficients(&r->out, coefficients);
  for (jpeg_saved_marker_ptr m = r->in.marker_list; m != NULL; m = m->next) {
    /* libjpeg writes its own JFIF and Adobe markers. */
    int jfif = m->marker == JPEG_APP0 && m->data_length >= 4 && memcmp(m->data, "JFIF", 4) == 0;
    int adobe = m->marker == JPEG_APP0 + 14 && m->data_length >= 5 && memcmp(m->data, "Adobe", 5) == 0;
    if ((jfif && r->out.write_JFIF_header) || (adobe && r->out.write_Adobe_marker)) continue;
    jpeg_write_marker(&r->out, m->marker, m->data, m->data_length);
  }
  jpeg_finish_compress(&r->out);
  jpeg_finish_decompress(&r->in);
  failed = 0;
done:
  if (r->out_alive) jpeg_destroy_compress(&r->out);
  if (r->in_alive) jpeg_destroy_decompress(&r->in);
  free(r);
  if (failed) {
    free(*out);
    *out = NULL;
    *out_size = 0;
  }
  return failed;
}

void stoker_jpeg_free_bytes(unsigned char *bytes) { free(bytes); }

void stoker_jpeg_free(struct stoker_jpeg *j) {
  if (j == NULL) return;
  if (j->alive) jpeg_destroy_decompress(&j->c);
  free(j);
}
