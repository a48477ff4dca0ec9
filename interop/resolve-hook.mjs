// Retries a failing relative specifier as a file (`.js`) or a directory (`/index.js`).
export async function resolve(specifier, context, next) {
  try {
    return await next(specifier, context);
  } catch (err) {
    const relative = specifier === '.' || specifier === '..' || specifier.startsWith('./') || specifier.startsWith('../');
    if (!relative) {
      throw err;
    }
    const base = specifier.endsWith('/') ? specifier.slice(0, -1) : specifier;
    const candidates = base === '.' || base === '..' ? [`${base}/index.js`] : [`${base}.js`, `${base}/index.js`];
    for (const candidate of candidates) {
      try {
        return await next(candidate, context);
      } catch {
        // try the next form
      }
    }
    throw err;
  }
}
